// The binary that owns the tests' precompiled headers (CMake reuses a target's
// precompiled header only from another target); it does nothing.
int main() { return 0; }
