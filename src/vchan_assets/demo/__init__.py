"""`vchan demo`: the whole pipeline on generated data, checked, in three settings.

- `direct`: on the embedded stack in this process (produce, sync, flush, lifecycle, checks).
- `via_dagster`: the same driven by the Dagster daemon's sensors and runs (`vchan up`'s stack).
- `cluster`: on a 3-member etcd, a Spark standalone master with workers and an S3 server,
  all started on loopback and stopped after.

May import: everything but `cli` (the demos use the Dagster definitions, the services of
`deploy` and the whole domain).
"""
