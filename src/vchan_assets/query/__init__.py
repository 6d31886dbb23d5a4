"""The read side: what a reader sees of a collection, and the ways it is read.

Owns:
- `view`: the query view of a vchannel (Milvus' GetQueryVChanPositions): which segments
  a reader may see and as what (flushed, growing, L0, dropped; compaction lineage
  resolved) and the seek position. Every reader selects its segments through it.
- `reads`: rows of one segment or of a whole collection as Arrow tables, deletes applied
  (Milvus' rule: a delete removes the older rows of its pk in its partition). The
  catalog's `read_segment` / `read_collection` and the Spark source read through it.
- `asof`: reads at a timestamp (`as_of`, default now): the time checked against the
  time-travel window, segment meta as it stood then, and the log after each checkpoint.
- `checks`: the view of a vchannel in figures (what it serves as flushed, growing, invisible,
  L0; the seek position; flush -> sorted seconds) and its two checks: a read at T through
  the view serves each live row of the log up to T once; the flushed segments waiting for
  their sort stay within VCHAN_INVISIBLE_SEGMENT_LIMIT (Dagster's `visible_segments`).
- `spark_source`: `spark.read.format("vchan")`, PySpark's Python data source over the same
  rows; `spark_source.spark_session(system)` is a session with it registered, and
  `spark_source.register(spark)` registers it on any other session. (Imported on its
  own: it imports pyspark, which the pandas readers do not need.)
- `search`: the k nearest rows of query vectors at a timestamp over the same parts a read
  sees: segments with a finished index through faiss, the rest exactly; deletes applied,
  the k best merged (`Catalog.search`, `vchan search`); `search_options`: its options as
  one value (`SearchOptions`), checked when made and passed whole down to the request
  check; `batch_search`: the same search with the segments searched by Spark tasks.
- `stream_source`: `spark.readStream.format("vchan")`, the same source's change stream:
  the inserts and deletes of the log by vchannel offsets, registered in etcd so log
  retention keeps what a stream has not committed (`datacoord.streams`).
- `source_options`: the options and Spark field types both share.
- `prune`: pk conditions and partitions prune segments by their stats logs.

May import: the domain below it (indexes, datacoord, datanode, lifecycle, imports, wal,
meta, storage, model), `stack` to open the system in Spark workers, and `spark` for sessions.
Never `catalog`, `status`, `defs`, `deploy`, `demo` or `cli`: those read through here.
"""

from vchan_assets.query.reads import read_collection, read_segment
from vchan_assets.query.view import QueryView, query_view, read_query_view

__all__ = ["QueryView", "query_view", "read_collection", "read_query_view", "read_segment"]
