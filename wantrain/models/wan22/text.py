"""Prompt cleaning as diffusers' Wan pipelines and the original Wan code do it, so that a caption tokenizes the same
at training and at inference (``pipelines/wan/pipeline_wan.py``: ``prompt_clean``).

ftfy is a wantrain dependency, so the cleaning never depends on what happens to be installed: curly quotes,
full-width letters and punctuation, and mojibake become what ftfy makes of them, as in a pipeline with ftfy.
"""

from __future__ import annotations

import html

import ftfy
import regex

# Part of the text cache key: a new cleaning (or ftfy release) must not reuse embeddings of the old one.
CLEANING = f"ftfy-{ftfy.__version__}+html-unescape-2x+whitespace"


def clean_prompt(text: str) -> str:
    """``ftfy.fix_text``, HTML entities unescaped twice, every whitespace run (Unicode ``\\s``) one space, stripped."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip()
