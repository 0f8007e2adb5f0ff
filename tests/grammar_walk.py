"""Drive a grammar's `Constraint` the way a model with random weights would: a seeded random choice
among the tokens its mask allows, until it allows only EOS (or a step limit)."""

from __future__ import annotations

import numpy as np

from provider.grammar import Constraint, TokenTable


def allowed(constraint: Constraint) -> np.ndarray:
    row = np.zeros(constraint.words, dtype=np.int32)
    constraint.fill(row)
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def walk(constraint: Constraint, table: TokenTable, seed: int, limit: int = 2000,
         eos_weight: float = 0.0) -> tuple[list[int], bool]:
    """(tokens, ended): EOS is taken as soon as it is the only choice, or with `eos_weight` where allowed."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(limit):
        choices = allowed(constraint)
        eos = [t for t in choices if t in table.eos_ids]
        rest = [t for t in choices if t not in table.eos_ids]
        if eos and (not rest or rng.random() < eos_weight):
            return out, True
        token = int(rng.choice(rest))
        constraint.consume(token)
        out.append(token)
    return out, False
