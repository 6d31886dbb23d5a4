"""DataCoord role: collections, segment allocation, flush, recovery info, orphans."""
