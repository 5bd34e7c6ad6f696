"""Alt text filled into HTML and Markdown where it is missing (``captioner alt-text``).

- ``finders``: the images without alt text, found by the documents' own parsers (``html.parser``,
  markdown-it-py) with their places in the source, and where each one's file is;
- ``documents``: a document read in an encoding it can be written back in byte for byte, the alt
  text inserted at those places and nowhere else, the unified diff, the atomic write;
- ``decide``: which captions are written and which are held for a person (never a guess);
- ``cache``: captions kept by the image's content hash, so that a second run costs no search.

Plain Python: the command (``captioner.cli.alt_text``) brings the model.
"""
