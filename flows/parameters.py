"""The parameter types the flows share (`extract` and `preflight`): validated by Prefect before a run starts,
rendered as form fields in the UI."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

__all__ = ["DEFAULT_LAYERS", "LayerSpec", "OutputUri", "Positive", "Seconds"]

#: the layers a run captures unless told: DFlash's five, spread over the model
DEFAULT_LAYERS = "dflash:5"

LayerSpec = Annotated[str, Field(pattern=r"^\s*(dflash:[1-9]\d*|eagle3|\d+(\s*,\s*\d+)*)(\+last)?\s*$",
                                  description="dflash:N, eagle3, or layer ids like 1,16,31; +last adds the last "
                                              "decoder layer (eagle3+last: for speculators)")]
OutputUri = Annotated[str, Field(pattern=r"^(file:///|/|s3://[^/\s]+)",
                                 description="file:///absolute/path or s3://bucket/prefix")]
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
