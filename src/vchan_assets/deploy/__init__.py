"""The services a machine runs beside the system's own processes, started and supervised
as child processes: the Dagster service (webserver, daemon) and the local Spark Connect
server it uses (`service`, `spark_connect`, `supervisor`), and on loopback for the cluster
tests and `vchan demo --cluster`: a 3-member etcd with TLS and users, a Spark standalone
master with workers, an S3 server (`etcd_cluster`, `spark_standalone`, `s3_server`);
`processes` has what they share (spawning, stopping a process tree, waiting).

May import: `meta` (the embedded etcd's process helpers), `spark`, `config`, `model`.
Opening the system itself is `stack`; the demos that run on these services are `demo`.
"""
