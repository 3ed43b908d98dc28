"""What a student sees: figures, widgets, pictures of networks, the library's code shown in a lesson, the site."""
