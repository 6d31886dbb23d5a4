"""Running the system on one machine: the Dagster service (webserver, daemon, Spark
Connect) as supervised child processes, and the Dagster demo. Next to `stack.py`
(embedded etcd + storage) and `demo.py` (the direct demo)."""
