"""Reading the results of a batched multi-rank run (tests only): each rank returns ``{check: result}``."""


def of(out: list[dict], check: str) -> list:
    """Every rank's result of ``check``; fails with the rank's traceback where the check raised
    there (its result is then ``{"error": "Traceback ..."}``)."""
    found = [ranks[check] for ranks in out]
    for rank, result in enumerate(found):
        error = result.get("error") if isinstance(result, dict) else None
        assert not (isinstance(error, str) and error.startswith("Traceback")), f"rank {rank}:\n{error}"
    return found
