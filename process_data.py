"""Tokenizing, run from the repository root: ``python process_data.py --input-file ... --output-dir ...
--model-name-or-path ...``. The pipeline and its manual: ``minitrainer/data/process_data.py``
(``python -m minitrainer.data.process_data``, or ``minitrainer-process-data`` once installed)."""

from minitrainer.data.process_data import *  # noqa: F403
from minitrainer.data.process_data import ProcessDataConfig, cli, main, process_data  # noqa: F401

if __name__ == "__main__":
    cli()
