"""Object storage: one pyarrow filesystem for local paths and S3, and the file layouts."""

from vchan_assets.storage.fs import ObjectExistsError, Storage, StorageError

__all__ = ["ObjectExistsError", "Storage", "StorageError"]
