import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # spawned workers import tests/ddp_worker.py
