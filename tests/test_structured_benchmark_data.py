"""The JSON-extraction tasks of ``benchmarks/structured_outputs.py`` are well formed: 32
unique tasks, every schema a valid JSON Schema (``jsonschema_rs``) that llguidance accepts,
and of the shapes the benchmark claims to cover."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs

from smcspec.potentials import JsonSchema

TASKS = Path(__file__).parents[1] / "benchmarks" / "data" / "json_extraction.jsonl"


def _walk(schema: dict):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"])


def test_tasks_are_valid_schemas_of_realistic_shape():
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    assert len(tasks) == 32 and len({t["id"] for t in tasks}) == 32
    shapes = {"nested": 0, "enum": 0, "array": 0, "range": 0}
    for t in tasks:
        assert t["prompt"].strip() and isinstance(t["schema"], dict)
        assert jsonschema_rs.meta.is_valid(t["schema"]), t["id"]
        JsonSchema(t["schema"])  # llguidance builds its grammar (ConfigError otherwise)
        nodes = list(_walk(t["schema"]))
        shapes["nested"] += any(n.get("type") == "object" for n in nodes[1:])
        shapes["enum"] += any("enum" in n for n in nodes)
        shapes["array"] += any(n.get("type") == "array" for n in nodes)
        shapes["range"] += any("minimum" in n and "maximum" in n for n in nodes)
        for n in nodes:
            if n.get("type") == "object":
                assert n.get("additionalProperties") is False, t["id"]
    assert min(shapes.values()) >= 12, shapes
