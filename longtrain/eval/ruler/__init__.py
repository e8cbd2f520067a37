"""RULER's synthetic long-context tasks (Hsieh et al. 2024, github.com/NVIDIA/RULER), generated here.

  values.py   the random keys and values: pseudo-words, numbers, UUIDs (from a seeded generator)
  prompts.py  the task families' templates and generators: a prompt of a given token length
  scoring.py  RULER's exact-match scoring (string_match_all)
  task.py     `longtrain eval --task ruler`: every task at 4k, 8k, ... --max-len tokens
"""
