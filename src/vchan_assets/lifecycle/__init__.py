"""The segment lifecycle after flush: sort by pk (stats task), L0 and mix compaction,
garbage collection and log retention."""
