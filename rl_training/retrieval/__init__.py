"""Retrieval: the Retriever interface and corpus (retriever.py), BM25 in process, a FAISS dense index, the HTTP
client and server (`python -m rl_training.retrieval.server`), and make_retriever for search.* (build.py).
May import: base, config, data. Owns no task: tasks/search/ uses it; cluster/ starts and probes its server."""
