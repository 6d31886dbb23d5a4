"""Vector indexes: the DataCoord's index side.

Owns (empty until the index side is built): index meta (`meta/field-index/...`: one index
per vector field, created and soft-dropped), segment index tasks and their meta
(`meta/segment-index/...`), the build of a segment's index files under
`index_files/{buildID}/{version}/`, the index engine versions, and the garbage collection
of index files. The task scheduler that runs the builds beside the sort lives with the
other DataCoord roles; search over the indexes lives in `query`.

May import: `lifecycle` (sorted segments are what gets indexed), `datacoord`, `datanode`,
`wal`, `meta`, `storage`, `model`, `spark`, `system`. Never `query`, `catalog`, `defs`,
`deploy`, `demo` or `cli`.
"""
