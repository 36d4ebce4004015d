"""Print one of the README's two opening commands: `start` (the first) or `test` (the second).

They are the first two lines of the first ```bash block in README.md.
"""

import sys
from pathlib import Path

lines = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text().splitlines()
start = lines.index("```bash") + 1
block = lines[start : lines.index("```", start)]
commands = [line for line in block if line.strip() and not line.lstrip().startswith("#")]
print(commands[{"start": 0, "test": 1}[sys.argv[1]]])
