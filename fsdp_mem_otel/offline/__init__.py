"""The offline tools, without torch: the JSON-lines format and its readers, the run index, the
HTML report, ``compare`` and the text tables."""
