# Installed by the course into <environment>/etc/ipython/: every Jupyter kernel of the course's environment starts
# the rank server as the kernel starts (course_lib.runtime.forkserver imports no torch), so a lesson's first launch does not
# wait seconds for the server's imports.
c = get_config()  # noqa: F821 - provided by IPython when it reads this file
c.InteractiveShellApp.exec_lines = ["import course_lib.runtime.forkserver"]
