"""Data sources that need no download (see `openk3.data.corpus`)."""

from openk3.data.corpus import Document, builtin_corpus, describe, iter_documents

__all__ = ["Document", "builtin_corpus", "describe", "iter_documents"]
