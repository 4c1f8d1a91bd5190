"""`pulumi up` starts here (Pulumi.yaml: `main: infra/`). The program is infra/aws/program.py."""

import sys
from pathlib import Path

# Pulumi runs this file as a script from infra/; make the project importable without an install.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.aws.program import main

main()
