"""For the tests and the benchmarks, not for production: real processes under faults.

Owns `harness`: `vchan datanode` / `vchan datacoord` processes on one set of settings with
short timings, producers of known rows, the exactly-once check that reads the binlogs back
with plain pyarrow, and seeded chaos schedules (kill -9, SIGSTOP, etcd restarts).

May import: anything below the command (`cli` starts as a process, never imported).
"""
