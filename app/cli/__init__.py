"""The `moechat` command line: the parser and its wiring (`main.py`), argparse value types, the load flags that
`run` and `serve` share, the one-line error guard, and the two commands that are plain Python: `fit` (will it run
here, how fast) and `pull` (download from the Hub). Imports neither torch nor Textual at start-up."""
