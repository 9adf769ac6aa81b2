"""`auth.spent`: budgets an instance saw spent, told to every instance so that each refuses them from memory."""

from __future__ import annotations

from pydantic import RootModel


class SpentBudgets(RootModel[list[tuple[str, str, int]]]):
    """Each budget as (rule id, counter key, end of its window); an end of 0 says counts went back and the budget
    may have room."""
