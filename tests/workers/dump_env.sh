#!/bin/sh
# A --no-python entry point: prints the rank's environment, like dump_env.py
echo "ENV {\"RANK\": \"$RANK\", \"WORLD_SIZE\": \"$WORLD_SIZE\", \"LOCAL_RANK\": \"$LOCAL_RANK\", \"args\": \"$*\"}"
