"""The read side in Dagster: the `visible_segments` asset (the query view of a vchannel), its checks, job and sensor."""
