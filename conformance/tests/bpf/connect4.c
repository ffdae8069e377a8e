/* A minimal cgroup/connect4 program for the socket-LB detection test: it allows every
 * connect() unchanged (a real socket LB rewrites the address here). Built with Debian's clang
 * (-target bpf) by scripts/kernels/run.sh and attached with bpftool inside the kernel
 * matrix's VM only, whose root cgroup is its own. No headers: the context is not read. */
__attribute__((section("cgroup/connect4"), used)) int allow_connect4(void *ctx)
{
	return 1;
}

char _license[] __attribute__((section("license"), used)) = "GPL";
