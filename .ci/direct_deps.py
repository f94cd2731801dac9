"""Print the names of pyproject.toml's direct dependencies (all extras), one a line."""

import re
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
specs = list(project["project"]["dependencies"])
for extra in project["project"]["optional-dependencies"].values():
    specs += extra
names = {re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}
print("\n".join(sorted(n for n in names if n != "prefixgate")))
