"""Dense retrieval: a FAISS index over a corpus, queried with a named encoder (GPU clusters).

This is Search-R1's setup (search_r1/search/retrieval_server.py, `DenseRetriever` + `Encoder`): the index is
built offline over wiki-18 (e.g. their e5_Flat.index), the encoder embeds the queries the same way it
embedded the passages: e5 models get the prefix 'query: ', bge models 'Represent this sentence for
searching relevant passages: '; mean pooling over the attention mask, then L2 normalisation (except dpr).
Row i of the index is line i of the corpus file.

faiss is not a dependency of this project (no wheel for every platform; GPU builds come from conda or the
site): without it, building a DenseRetriever fails at once with one line saying what to install.
"""

from __future__ import annotations

import time

import numpy as np

from rl_training.retrieval.retriever import Passage, RetrievalResult, load_corpus


def _require_faiss():
    try:
        import faiss
    except ImportError:
        raise RuntimeError(
            "the dense retriever needs faiss, which is not installed here: install faiss-cpu (pip) or a GPU "
            "build (conda install -c pytorch faiss-gpu), or serve BM25 (--retriever bm25)"
        ) from None
    return faiss


def query_prefix(encoder_name: str) -> str:
    name = encoder_name.lower()
    if "e5" in name:
        return "query: "
    if "bge" in name:
        return "Represent this sentence for searching relevant passages: "
    return ""


class Encoder:
    """A named text encoder (local path or hub id) embedding queries as Search-R1's `Encoder` does."""

    def __init__(self, name: str, device: str = "cpu", max_tokens: int = 256):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.name, self.device, self.max_tokens = name, device, max_tokens
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name)
            self.model = AutoModel.from_pretrained(name, dtype=dtype).to(device).eval()
        except OSError as e:  # not on disk, not in the cache, no network (compute nodes run offline)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"cannot load the encoder {name!r} ({first}); offline, pass a local directory") from None

    def encode(self, texts: list[str], prefix: str = "") -> np.ndarray:
        """[len(texts), hidden] float32: mean of the last hidden states over the attention mask, L2
        normalised (except dpr models)."""
        import torch

        with torch.no_grad():
            inputs = self.tokenizer(
                [prefix + t for t in texts],
                max_length=self.max_tokens,
                padding=True,
                truncation=True,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1)
            if "dpr" not in self.name.lower():
                emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.float().cpu().numpy()


class DenseRetriever:
    def __init__(
        self,
        index_path: str,
        corpus_path: str,
        encoder: str,
        *,
        device: str = "cpu",
        faiss_gpus: tuple[int, ...] = (),
        max_query_tokens: int = 256,
        batch_size: int = 512,
    ):
        faiss = _require_faiss()
        self.passages = load_corpus(corpus_path)
        self.index = faiss.read_index(index_path)
        if self.index.ntotal != len(self.passages):
            raise ValueError(f"{index_path} holds {self.index.ntotal} vectors for {len(self.passages)} passages")
        if faiss_gpus:  # only the GPUs named: a retriever started per node must not take the trainers' (N8)
            co = faiss.GpuMultipleClonerOptions()
            co.useFloat16, co.shard = True, True
            self.index = faiss.index_cpu_to_gpus_list(self.index, co=co, gpus=list(faiss_gpus))
        self.encoder = Encoder(encoder, device, max_query_tokens)
        self.prefix, self.batch_size = query_prefix(encoder), batch_size

    def retrieve(self, queries: list[str], topk: int) -> RetrievalResult:
        t0 = time.perf_counter()
        out: list[list[Passage]] = []
        for s in range(0, len(queries), self.batch_size):
            emb = self.encoder.encode(list(queries[s : s + self.batch_size]), self.prefix)
            scores, idx = self.index.search(emb, topk)
            for row_s, row_i in zip(scores.tolist(), idx.tolist(), strict=True):
                out.append([self._passage(i, sc) for i, sc in zip(row_i, row_s, strict=True) if i >= 0])
        return RetrievalResult(out, [None] * len(out), latency_s=time.perf_counter() - t0)

    def _passage(self, i: int, score: float) -> Passage:
        p = self.passages[i]
        return Passage(p.id, p.contents, float(score))

    def close(self) -> None:
        pass
