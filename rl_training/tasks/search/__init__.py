"""The search task family (Search-R1): the SearchTask environment (task.py), answer grading (reward.py), the
synthetic task (synthetic.py). May import: base, config, data, retrieval (the retrievers and their server, which
this family owns an instance of, built in SearchTask.start) and tasks.base. docs/search.md is the manual.
"""
