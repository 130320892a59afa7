import sys

from vllm_kvplugin.server import main

sys.exit(main())
