"""For the tests and the benchmarks, not for production: what the tests share.

Owns `fixtures` (the pytest plugin of the tests' fixtures: real etcd, storage, Spark, the
test's `System`, `Producer` and collection), `steps` (in-process syncs, compactions, GC
passes, flushed rounds and the lifecycle's invariants), `waiting` (the one `wait_until`),
the data of the index and import tests, and `harness`: `vchan datanode` / `vchan datacoord`
processes on one set of settings with short timings, producers of known rows, the
exactly-once check that reads the binlogs back with plain pyarrow, and seeded chaos
schedules (kill -9, SIGSTOP, etcd restarts).

May import: anything below the command (`cli` starts as a process, never imported).
"""
