"""Vector indexes in Dagster: the `segment_indexes` asset (the index builds of a vchannel's sorted segments), its checks, job and sensor."""
