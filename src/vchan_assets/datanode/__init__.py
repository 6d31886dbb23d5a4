"""DataNode role: persisting vchannels into binlogs, segment meta and checkpoints."""
