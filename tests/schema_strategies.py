"""Hypothesis strategies for JSON schemas a structured-output request may carry: objects of
strings, bounded integers, booleans, nulls, enums, arrays and nested objects, with required
lists. Lengths, item counts and numbers are bounded, and no object takes properties it does not
name, so that even a random model's output must end within a few hundred tokens."""

from hypothesis import strategies as st

NAMES = st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True)
LEAVES = st.one_of(
    st.builds(lambda lo, more: {"type": "string", "minLength": lo, "maxLength": lo + more},
              st.integers(0, 3), st.integers(0, 10)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 10_000)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(NAMES, st.integers(-5, 5)), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def objects(children) -> st.SearchStrategy[dict]:
    def build(props: dict, required: list[bool]) -> dict:
        return {"type": "object", "properties": props, "required": [k for k, r in zip(props, required) if r],
                "additionalProperties": False}
    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda req: build(props, req)))


def arrays(children) -> st.SearchStrategy[dict]:
    return st.builds(lambda items, lo, more: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + more},
                     children, st.integers(0, 2), st.integers(0, 3))


# A JSON object at the top, as OpenAI's json_schema response format has it.
SCHEMAS = objects(st.recursive(LEAVES, lambda c: st.one_of(objects(c), arrays(c)), max_leaves=6))
