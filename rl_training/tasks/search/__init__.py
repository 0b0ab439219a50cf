"""The search task family (Search-R1): retrievers, the retrieval server, answer grading, the synthetic task.

docs/search.md is the manual. Layers, bottom up: retriever.py (interface, corpus, observation text) <- bm25.py,
client.py, dense.py <- server.py, build.py; reward.py and synthetic.py beside them.
"""
