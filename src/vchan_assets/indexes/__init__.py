"""Vector indexes: the DataCoord's index side (docs/indexes.md).

Owns:
- `params`: what each index type (FLAT, IVF_FLAT, IVF_PQ, HNSW) takes when it is created
  and searched, and the values a build of one segment uses.
- `meta`: index meta in etcd: `meta/field-index/{coll}/{index}` (one index per vector
  field, created idempotently, soft-dropped) and `meta/segment-index/{coll}/{part}/{seg}/
  {build}` (one build per sorted segment and index: Unissued -> InProgress -> Finished /
  Failed, a version per start), and how far an index is built (`collection_progress`).
- `build`: the build of one segment's index with faiss (`index_files/{build}/{version}/
  index.faiss`), run in a Spark task or in process, and loading it back.
- `sparse`: a sparse float vector field's inverted index (SPARSE_INVERTED_INDEX,
  SPARSE_WAND) with scipy.sparse (`index.sparse.npz`), and the product that searches it.
- `step`: `IndexBuilder` (start the Unissued builds, build them in one Spark job or here,
  commit each: file first, then one transaction) and `index_step`, the periodic scan that
  creates the builds of newly sorted segments and runs them.

The records (`FieldIndex`, `SegmentIndex`) live in `model` and their keys in `meta.keys`,
so that layers below this one (the DataCoord's scheduler, garbage collection) can read
them without importing this package. Search over the indexes lives in `query`.

May import: `lifecycle` (sorted segments are what gets indexed), `datacoord`, `datanode`,
`wal`, `meta`, `storage`, `model`, `spark`, `system`. Never `query`, `catalog`, `defs`,
`deploy`, `demo` or `cli`.
"""
