"""One user-facing failure type and the CLI wrapper that turns it into one sentence and exit code 2."""
from __future__ import annotations

import sys
from typing import Callable


class QATError(Exception):
    """A problem the user can fix. The message is one sentence naming the problem and the fix."""


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; a QATError becomes ``error: <sentence>`` on stderr and exit status 2."""
    try:
        main()
    except QATError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted; files already written are complete, nothing half-written was kept.",
              file=sys.stderr)
        sys.exit(130)
