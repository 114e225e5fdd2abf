"""Model quality measured on text: perplexity by llama.cpp's protocol (:mod:`tessera.eval.perplexity`), the texts
to measure it on (:mod:`tessera.eval.corpus`), and what each weight and KV cache format costs
(:mod:`tessera.eval.quant_report`, imported from there: it loads the model stack, which perplexity alone does not
need)."""

from tessera.eval.corpus import CORPORA, corpus_text, pydoc_corpus, read_text, write_corpus
from tessera.eval.perplexity import PerplexityResult, RunningPPL, perplexity, tokenize

__all__ = ["CORPORA", "PerplexityResult", "RunningPPL", "corpus_text", "perplexity", "pydoc_corpus", "read_text",
           "tokenize", "write_corpus"]
