"""tinyvllm's command line: python main.py generate | chat | serve | bench ..."""
import sys

from tinyvllm.cli import main

if __name__ == "__main__":
  sys.exit(main())
