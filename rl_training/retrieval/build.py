"""The retriever a config names (search.*), built once at setup."""

from __future__ import annotations

from rl_training.config.schema import SearchCfg
from rl_training.retrieval.retriever import NullRetriever, Retriever


def make_retriever(cfg: SearchCfg) -> Retriever:
    if cfg.retriever == "none":
        return NullRetriever()
    if cfg.retriever == "bm25":
        from rl_training.retrieval.bm25 import BM25Retriever

        return BM25Retriever.from_corpus(cfg.corpus, cfg.bm25_index)
    if not cfg.url:
        raise ValueError("search.retriever=http needs search.url (http://host:port/retrieve)")
    from rl_training.retrieval.client import HttpRetriever

    return HttpRetriever(cfg.url, timeout_s=cfg.timeout_s, retries=cfg.retries, request_shape=cfg.request_shape)
