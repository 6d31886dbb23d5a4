"""vchan_assets: Milvus-style DataNode/DataCoord persistence of vchannels into binlogs."""

__version__ = "0.1.0"
