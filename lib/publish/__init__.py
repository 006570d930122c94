"""From evidence only: report tables, the book, the notebook writer."""
