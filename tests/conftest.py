"""The tests' fixtures (`etcd`, `settings`, `store`, `storage`, `system`, `producer`,
`collection`, `private_etcd`, `s3_server`, `spark_remote`, ...) are those of the pytest
plugin `vchan_assets.testing.fixtures`; the steps they share are in `vchan_assets.testing`."""

pytest_plugins = ["vchan_assets.testing.fixtures"]
