"""Retrieval server: Search-R1's /retrieve schema over a BM25 or a FAISS index, plus /health.

    # BM25 over a corpus (CPU; any machine):
    python -m rl_training.retrieval.server --corpus data/search/corpus.jsonl --port 8000
    # FAISS e5 over wiki-18 on a GPU node, as Search-R1 serves it (needs faiss, see rl_training/retrieval/dense.py):
    python -m rl_training.retrieval.server --retriever dense --corpus wiki-18.jsonl --index e5_Flat.index \\
        --encoder intfloat/e5-base-v2 --device cuda:7 --faiss-gpus 7 --port 8000
    # an ephemeral port, written to a file once the index is built and the socket listens (tests, SLURM):
    python -m rl_training.retrieval.server --corpus ... --port 0 --port-file /tmp/retriever.port

POST /retrieve accepts Search-R1's batched request {"queries": [...], "topk": k, "return_scores": b} and
SkyRL's single-query request {"query": "...", ...} (exactly one of the two); the answer is
{"result": [per query: [{"document": {"id", "contents"}, "score": s}, ...]]}, or the bare documents when
return_scores is false. topk defaults to --topk. GET /health gives {"status": "ok", "retriever": ...,
"passages": N}. The server binds 127.0.0.1 unless --host says otherwise: a retriever is internal traffic.
"""

# No `from __future__ import annotations`: FastAPI must see the request model class itself, defined in a function.
import argparse
import os
import socket
import sys
from pathlib import Path

from rl_training.retrieval.retriever import Retriever

MAX_TOPK = 100


def make_app(retriever: Retriever, *, default_topk: int = 3, name: str = "bm25", passages: int = 0):
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    class RetrieveRequest(BaseModel):
        queries: list[str] | None = None  # Search-R1: a batch
        query: str | None = None  # SkyRL: one query
        topk: int | None = None
        return_scores: bool = False

    app = FastAPI(title="rl_training retriever")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "retriever": name, "passages": passages}

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict:  # sync: FastAPI runs it in its thread pool
        if (req.queries is None) == (req.query is None):
            raise HTTPException(422, 'give exactly one of "queries" (a list) and "query" (a string)')
        topk = req.topk or default_topk
        if not 1 <= topk <= MAX_TOPK:
            raise HTTPException(422, f"topk must be in [1, {MAX_TOPK}], got {topk}")
        queries = req.queries if req.queries is not None else [req.query]
        res = retriever.retrieve(queries, topk)
        if res.failed:
            raise HTTPException(500, f"retrieval failed: {next(e for e in res.errors if e)}")
        rows = []
        for hits in res.passages:
            docs = [{"id": p.id, "contents": p.contents} for p in hits]
            rows.append([{"document": d, "score": p.score} for d, p in zip(docs, hits)] if req.return_scores else docs)
        return {"result": rows}

    return app


def build_retriever(a: argparse.Namespace) -> tuple[Retriever, int]:
    if a.retriever == "bm25":
        from rl_training.retrieval.bm25 import BM25Retriever

        r = BM25Retriever.from_corpus(a.corpus, a.bm25_index)
        return r, len(r)
    from rl_training.retrieval.dense import DenseRetriever

    if not a.index or not a.encoder:
        raise SystemExit("server: --retriever dense needs --index (a FAISS index file) and --encoder (a model)")
    gpus = tuple(int(g) for g in a.faiss_gpus.split(",") if g.strip())
    r = DenseRetriever(a.index, a.corpus, a.encoder, device=a.device, faiss_gpus=gpus)
    return r, len(r.passages)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections queue from here on, before uvicorn accepts
    return sock


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help='jsonl of {"id", "contents"} (Search-R1 / wiki-18 form)')
    ap.add_argument("--retriever", choices=["bm25", "dense"], default="bm25")
    ap.add_argument("--bm25-index", default="", help="bm25: load the index from this directory, or build and save it")
    ap.add_argument("--index", default="", help="dense: FAISS index file (row i = corpus line i)")
    ap.add_argument("--encoder", default="", help="dense: query encoder, a local path or hub id (e.g. e5-base-v2)")
    # CPU by default: a retriever started per node beside the trainers would otherwise land on GPU 0, where rank 0
    # trains and its engine lives (issue 29, N8); name a free GPU to use one.
    ap.add_argument("--device", default="cpu", help="dense: device of the encoder (cpu, or cuda:N for a free GPU)")
    ap.add_argument("--faiss-gpus", default="", help="dense: shard the index over these GPUs, e.g. 6,7 ('' = CPU)")
    ap.add_argument("--topk", type=int, default=3, help="topk of requests that give none")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 = any free port (see --port-file)")
    ap.add_argument("--port-file", default="", help="write the bound port here once the server accepts connections")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)

    import uvicorn

    retriever, n = build_retriever(a)
    app = make_app(retriever, default_topk=a.topk, name=a.retriever, passages=n)
    sock = listen(a.host, a.port)
    port = sock.getsockname()[1]
    print(f"server: {a.retriever} over {n} passages on http://{a.host}:{port}/retrieve", flush=True)
    if a.port_file:  # written whole, then renamed: a reader never sees a partial number
        tmp = Path(f"{a.port_file}.tmp{os.getpid()}")
        tmp.write_text(str(port))
        tmp.replace(a.port_file)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
