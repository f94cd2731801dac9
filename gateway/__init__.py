"""prefixgate subpackage."""

if __name__ != "prefixgate.gateway":  # the checkout's folder imported by its bare name
    from prefixgate.sdk._bare_name import step_aside

    step_aside(__name__, __file__)
