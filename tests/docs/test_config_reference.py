"""docs/configuration.md documents every key of configs/default.yaml with its default value."""
import os
import re

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fmt(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[]" if not v else str(v)
    return str(v)


def test_every_default_is_documented():
    defaults = yaml.safe_load(open(os.path.join(ROOT, "configs", "default.yaml")))
    doc = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    sections = {m.group(1): m.start() for m in re.finditer(r"^## (\S+)", doc, re.M)}
    for key, val in defaults.items():
        if isinstance(val, dict):
            assert key in sections, f"section {key} missing"
            start = sections[key]
            end = min([s for s in sections.values() if s > start] + [len(doc)])
            body = doc[start:end]
            for sub, sval in val.items():
                m = re.search(rf"^\| `{sub}` \| ([^|]+) \|", body, re.M)
                assert m, f"{key}.{sub} not documented"
                assert m.group(1).strip() == _fmt(sval), f"{key}.{sub}: doc says {m.group(1).strip()}, default {sval}"
        else:
            m = re.search(rf"^\| `{key}` \| ([^|]+) \|", doc, re.M)
            assert m and m.group(1).strip() == _fmt(val), key
