"""Command-line programs. Each module's ``main()`` is both a console script (``ds-seg-train``,
``ds-seg-predict``, ``ds-seg-evaluate``, ``ds-seg-export``, ``ds-seg-benchmark``,
``ds-seg-models``; see setup.py) and what ``launch/<name>.py`` runs in a source checkout."""
