"""``python -m captioner.onnx``: caption with an exported folder, without torch."""

import sys

from captioner.onnx.runtime import main

sys.exit(main())
