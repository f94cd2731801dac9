"""The blocking ``Client`` is used as openai-python's is: as a temporary, never
closed (the process still exits), from several threads, and inside a running event loop it
says to use ``AsyncClient``. Each scenario is a fresh interpreter (a hang is a timeout, the
point of the test) against the stub OpenAI server on loopback."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from support.stub_upstream import StubServer

HANG_S = 60  # a script that has not exited by then hangs


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    server = StubServer(name="stub-model", ttft_s=0.0, token_delay_s=0.0).start()
    yield server
    server.stop()


def run_script(stub: StubServer, body: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` (``URL`` is the stub's /v1) in a new interpreter; fail on a hang."""
    source = f"URL = {stub.base_url + '/v1'!r}\n" + textwrap.dedent(body)
    try:
        return subprocess.run(
            [sys.executable, *flags, "-c", source],
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script never exited; its output: {exc.stdout!r} {exc.stderr!r}")


def test_a_temporary_client_answers(stub: StubServer) -> None:
    out = run_script(
        stub,
        """
        from prefixgate.sdk import Client
        print(Client(URL).models.list().data[0].id)
        models = Client(URL).models  # the resource keeps the client's thread alive
        print(models.list().data[0].id)
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["stub-model", "stub-model"]


def test_an_unclosed_client_lets_the_process_exit_and_warns_at_most(stub: StubServer) -> None:
    out = run_script(
        stub,
        """
        from prefixgate.sdk import Client
        client = Client(URL)
        MSG = [{"role": "user", "content": "hi"}]
        print(client.chat.completions.create(model="m", messages=MSG).choices[0].message.content)
        stream = client.chat.completions.create(model="m", messages=MSG, stream=True, max_tokens=3)
        print(next(iter(stream)).choices[0].delta.role)  # a stream left open at exit
        """,
        "-W",
        "always::ResourceWarning",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "assistant"]
    assert "ResourceWarning: unclosed prefixgate.sdk.Client" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_collection_releases_the_thread_and_pool(stub: StubServer) -> None:
    out = run_script(
        stub,
        """
        import gc, threading, warnings
        from prefixgate.sdk import Client

        def loop_threads():
            return [t for t in threading.enumerate() if t.name == "prefixgate-client-loop"]

        unused = Client(URL)
        assert loop_threads() == []  # started on the first call only
        del unused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client = Client(URL)
            assert client.models.list().data[0].id == "stub-model"
            assert len(loop_threads()) == 1
            pool = client.async_client._http
            del client
            gc.collect()
            assert loop_threads() == [], loop_threads()
            assert pool.is_closed
        assert [w.category for w in caught] == [ResourceWarning], caught
        with Client(URL) as closed:
            closed.models.list()
        assert loop_threads() == []  # close() stopped it, no warning needed
        try:
            closed.models.list()
        except RuntimeError as exc:
            print(exc)
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "this Client is closed"


def test_threads_share_one_client(stub: StubServer) -> None:
    out = run_script(
        stub,
        """
        from concurrent.futures import ThreadPoolExecutor
        from prefixgate.sdk import Client

        client = Client(URL, max_concurrency=4)
        MSG = [{"role": "user", "content": "hi"}]

        def work(i):
            if i % 2:
                chunks = client.chat.completions.create(
                    model="m", messages=MSG, stream=True, max_tokens=3
                )
                return "".join(c.choices[0].delta.content or "" for c in chunks)
            return client.chat.completions.create(model="m", messages=MSG).choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(work, range(32)))
        assert answers == ["ok", "t0 t1 t2 "] * 16, answers
        assert client.async_client.limiter.in_flight == 0
        print(len(answers))
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "32"


def test_inside_an_event_loop_it_says_to_use_async_client(stub: StubServer) -> None:
    out = run_script(
        stub,
        """
        import asyncio
        from prefixgate.sdk import Client

        client = Client(URL)

        async def main():
            try:
                client.models.list()
            except RuntimeError as exc:
                print(exc)
            # from a worker thread of that loop it is fine
            models = await asyncio.to_thread(client.models.list)
            print(models.data[0].id)

        asyncio.run(main())
        """,
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert "AsyncClient" in first and "event loop" in first
    assert second == "stub-model"


def test_ctrl_c_in_a_blocking_stream_exits() -> None:
    """A Ctrl-C while a stream waits for its next chunk ends the script: the call left in
    flight on the loop thread is cancelled at exit, it does not hold the process."""
    silent = StubServer(name="silent", ttft_s=600.0).start()  # first chunk, then silence
    # A terminal's Ctrl-C reaches a script whose SIGINT is Python's default; a child of the
    # test process inherits that process's SIGINT disposition and mask instead: pytest started
    # in the background by a non-interactive shell (`pytest ... &`, as CI wrappers and job
    # runners do) has SIGINT ignored from the start (POSIX, for asynchronous commands without
    # job control), which made the script deaf to it. The script restores the terminal's case
    # first and reports what it inherited.
    source = textwrap.dedent(
        f"""
        import signal, sys
        inherited = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
        print("inherited SIGINT:", inherited, file=sys.stderr)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from prefixgate.sdk import Client
        client = Client({silent.base_url + "/v1"!r})
        stream = client.chat.completions.create(
            model="m", messages=[{{"role": "user", "content": "hi"}}], stream=True
        )
        print("streaming", flush=True)
        for chunk in stream:
            pass
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "streaming"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the interrupted script never exited")
    finally:
        silent.stop()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
