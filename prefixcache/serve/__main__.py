"""`python -m prefixcache.serve MODEL_OR_PATH [flags]` = `prefixcache serve MODEL_OR_PATH ...`."""

import sys

from prefixcache.serve.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv if argv[:1] == ["serve"] else ["serve", *argv]))
